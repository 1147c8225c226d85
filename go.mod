module github.com/cudapool/cudapool

go 1.26.0

require golang.org/x/sys v0.50.0
