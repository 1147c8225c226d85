//go:build race

package pages_test

// slowdown divides the seeds TestModel and TestSim run by default: the race detector
// makes them several times slower, and they share no memory between goroutines.
const slowdown = 6
