//go:build !race

package unixfd

const raceEnabled = false
