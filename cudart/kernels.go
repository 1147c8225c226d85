package cudart

import _ "embed" // the batch copy kernel's PTX

// batchCopyPTX is kernels/batchcopy.ptx, generated from kernels/batchcopy.cu (the
// command is at the top of the .cu): the kernel MemcpyBatchAsync launches on a GPU,
// loaded at run time so that no toolkit is needed to build.
//
//go:embed kernels/batchcopy.ptx
var batchCopyPTX string
