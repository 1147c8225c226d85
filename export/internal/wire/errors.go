package wire

import (
	"github.com/cudapool/cudapool/export"
)

// ReplyErr turns an Error frame into the error it stands for.
func ReplyErr(m *ErrorMsg) error {
	return &export.RemoteError{Err: CodeErrs[m.Code], Text: m.Text}
}
