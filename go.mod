module github.com/cudapool/cudapool

go 1.26.0

require (
	github.com/dustin/go-humanize v1.1.0
	golang.org/x/sys v0.50.0
)
