//go:build !race

package pages_test

// slowdown divides the seeds TestModel and TestSim run by default (race_test.go).
const slowdown = 1
