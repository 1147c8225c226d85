package intercept

// Every method of cudart.Runtime, each of one shape: a call nobody watches goes
// straight through; a watched one is a Call for the Before hooks, then (unless one set
// Err or answered) the runtime's, with the Call's Args, then the After hooks.
// A method cudart.Runtime gains and this file lacks goes straight to the wrapped
// runtime, unseen by the hooks: TestEveryMethodIsIntercepted fails, naming it.

import "github.com/cudapool/cudapool/cudart"

// The Runtime methods, by name.
const (
	mName                             = "Name"
	mDriverVersion                    = "DriverVersion"
	mRuntimeVersion                   = "RuntimeVersion"
	mDeviceCount                      = "DeviceCount"
	mDeviceAttribute                  = "DeviceAttribute"
	mDeviceUUID                       = "DeviceUUID"
	mDevicePCIBusID                   = "DevicePCIBusID"
	mDeviceCanAccessPeer              = "DeviceCanAccessPeer"
	mMemGetInfo                       = "MemGetInfo"
	mAllocationGranularity            = "AllocationGranularity"
	mStreamCreate                     = "StreamCreate"
	mStreamDestroy                    = "StreamDestroy"
	mStreamSynchronize                = "StreamSynchronize"
	mStreamDevice                     = "StreamDevice"
	mStreamWaitEvent                  = "StreamWaitEvent"
	mStreamNotify                     = "StreamNotify"
	mEventCreate                      = "EventCreate"
	mEventDestroy                     = "EventDestroy"
	mEventRecord                      = "EventRecord"
	mEventSynchronize                 = "EventSynchronize"
	mEventQuery                       = "EventQuery"
	mIpcGetEventHandle                = "IpcGetEventHandle"
	mIpcOpenEventHandle               = "IpcOpenEventHandle"
	mMemPoolCreate                    = "MemPoolCreate"
	mMemPoolDestroy                   = "MemPoolDestroy"
	mDeviceGetDefaultMemPool          = "DeviceGetDefaultMemPool"
	mMemPoolGetAttribute              = "MemPoolGetAttribute"
	mMemPoolSetAttribute              = "MemPoolSetAttribute"
	mMemPoolSetAccess                 = "MemPoolSetAccess"
	mMemPoolGetAccess                 = "MemPoolGetAccess"
	mMemPoolTrimTo                    = "MemPoolTrimTo"
	mMallocFromPoolAsync              = "MallocFromPoolAsync"
	mFreeAsync                        = "FreeAsync"
	mMemPoolExportToShareableHandle   = "MemPoolExportToShareableHandle"
	mMemPoolImportFromShareableHandle = "MemPoolImportFromShareableHandle"
	mMemPoolExportPointer             = "MemPoolExportPointer"
	mMemPoolImportPointer             = "MemPoolImportPointer"
	mMemcpyHtoDAsync                  = "MemcpyHtoDAsync"
	mMemcpyDtoHAsync                  = "MemcpyDtoHAsync"
	mMemcpyDtoDAsync                  = "MemcpyDtoDAsync"
	mMemsetAsync                      = "MemsetAsync"
	mHostRegister                     = "HostRegister"
	mHostUnregister                   = "HostUnregister"
	mHostDevicePointer                = "HostDevicePointer"
	mMemcpyBatchAsync                 = "MemcpyBatchAsync"
	mBatchCopyPath                    = "BatchCopyPath"
)

// methods is every Runtime method Runtime intercepts, in cudart.Runtime's order.
var methods = [...]string{mName, mDriverVersion, mRuntimeVersion, mDeviceCount, mDeviceAttribute, mDeviceUUID, mDevicePCIBusID, mDeviceCanAccessPeer, mMemGetInfo, mAllocationGranularity, mStreamCreate, mStreamDestroy, mStreamSynchronize, mStreamDevice, mStreamWaitEvent, mStreamNotify, mEventCreate, mEventDestroy, mEventRecord, mEventSynchronize, mEventQuery, mIpcGetEventHandle, mIpcOpenEventHandle, mMemPoolCreate, mMemPoolDestroy, mDeviceGetDefaultMemPool, mMemPoolGetAttribute, mMemPoolSetAttribute, mMemPoolSetAccess, mMemPoolGetAccess, mMemPoolTrimTo, mMallocFromPoolAsync, mFreeAsync, mMemPoolExportToShareableHandle, mMemPoolImportFromShareableHandle, mMemPoolExportPointer, mMemPoolImportPointer, mMemcpyHtoDAsync, mMemcpyDtoHAsync, mMemcpyDtoDAsync, mMemsetAsync, mHostRegister, mHostUnregister, mHostDevicePointer, mMemcpyBatchAsync, mBatchCopyPath}

// Name intercepts cudart.Runtime.Name.
func (r *Runtime) Name() string {
	if !r.watches(mName) {
		return r.Runtime.Name()
	}
	c := r.call(mName)
	v0 := r.Runtime.Name()
	c.Results = []any{v0}
	c.ran = true
	r.done(c)
	return result[string](c, 0)
}

// DriverVersion intercepts cudart.Runtime.DriverVersion.
func (r *Runtime) DriverVersion() (int, error) {
	if !r.watches(mDriverVersion) {
		return r.Runtime.DriverVersion()
	}
	c := r.call(mDriverVersion)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DriverVersion()
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[int](c, 0), c.Err
}

// RuntimeVersion intercepts cudart.Runtime.RuntimeVersion.
func (r *Runtime) RuntimeVersion() (int, error) {
	if !r.watches(mRuntimeVersion) {
		return r.Runtime.RuntimeVersion()
	}
	c := r.call(mRuntimeVersion)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.RuntimeVersion()
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[int](c, 0), c.Err
}

// DeviceCount intercepts cudart.Runtime.DeviceCount.
func (r *Runtime) DeviceCount() (int, error) {
	if !r.watches(mDeviceCount) {
		return r.Runtime.DeviceCount()
	}
	c := r.call(mDeviceCount)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DeviceCount()
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[int](c, 0), c.Err
}

// DeviceAttribute intercepts cudart.Runtime.DeviceAttribute.
func (r *Runtime) DeviceAttribute(dev int, attr cudart.DeviceAttr) (int, error) {
	if !r.watches(mDeviceAttribute) {
		return r.Runtime.DeviceAttribute(dev, attr)
	}
	c := r.call(mDeviceAttribute, dev, attr)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DeviceAttribute(arg[int](c, 0), arg[cudart.DeviceAttr](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[int](c, 0), c.Err
}

// DeviceUUID intercepts cudart.Runtime.DeviceUUID.
func (r *Runtime) DeviceUUID(dev int) (cudart.UUID, error) {
	if !r.watches(mDeviceUUID) {
		return r.Runtime.DeviceUUID(dev)
	}
	c := r.call(mDeviceUUID, dev)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DeviceUUID(arg[int](c, 0))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.UUID](c, 0), c.Err
}

// DevicePCIBusID intercepts cudart.Runtime.DevicePCIBusID.
func (r *Runtime) DevicePCIBusID(dev int) (string, error) {
	if !r.watches(mDevicePCIBusID) {
		return r.Runtime.DevicePCIBusID(dev)
	}
	c := r.call(mDevicePCIBusID, dev)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DevicePCIBusID(arg[int](c, 0))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[string](c, 0), c.Err
}

// DeviceCanAccessPeer intercepts cudart.Runtime.DeviceCanAccessPeer.
func (r *Runtime) DeviceCanAccessPeer(dev int, peer int) (bool, error) {
	if !r.watches(mDeviceCanAccessPeer) {
		return r.Runtime.DeviceCanAccessPeer(dev, peer)
	}
	c := r.call(mDeviceCanAccessPeer, dev, peer)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DeviceCanAccessPeer(arg[int](c, 0), arg[int](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[bool](c, 0), c.Err
}

// MemGetInfo intercepts cudart.Runtime.MemGetInfo.
func (r *Runtime) MemGetInfo(dev int) (uint64, uint64, error) {
	if !r.watches(mMemGetInfo) {
		return r.Runtime.MemGetInfo(dev)
	}
	c := r.call(mMemGetInfo, dev)
	if c.Err == nil && !c.answered {
		v0, v1, err := r.Runtime.MemGetInfo(arg[int](c, 0))
		c.Results, c.Err = []any{v0, v1}, err
		c.ran = true
	}
	r.done(c)
	return result[uint64](c, 0), result[uint64](c, 1), c.Err
}

// AllocationGranularity intercepts cudart.Runtime.AllocationGranularity.
func (r *Runtime) AllocationGranularity(dev int, ht cudart.HandleType, recommended bool) (uint64, error) {
	if !r.watches(mAllocationGranularity) {
		return r.Runtime.AllocationGranularity(dev, ht, recommended)
	}
	c := r.call(mAllocationGranularity, dev, ht, recommended)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.AllocationGranularity(arg[int](c, 0), arg[cudart.HandleType](c, 1), arg[bool](c, 2))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[uint64](c, 0), c.Err
}

// StreamCreate intercepts cudart.Runtime.StreamCreate.
func (r *Runtime) StreamCreate(dev int, flags cudart.StreamFlags) (cudart.Stream, error) {
	if !r.watches(mStreamCreate) {
		return r.Runtime.StreamCreate(dev, flags)
	}
	c := r.call(mStreamCreate, dev, flags)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.StreamCreate(arg[int](c, 0), arg[cudart.StreamFlags](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.Stream](c, 0), c.Err
}

// StreamDestroy intercepts cudart.Runtime.StreamDestroy.
func (r *Runtime) StreamDestroy(dev int, s cudart.Stream) error {
	if !r.watches(mStreamDestroy) {
		return r.Runtime.StreamDestroy(dev, s)
	}
	c := r.call(mStreamDestroy, dev, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.StreamDestroy(arg[int](c, 0), arg[cudart.Stream](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// StreamSynchronize intercepts cudart.Runtime.StreamSynchronize.
func (r *Runtime) StreamSynchronize(dev int, s cudart.Stream) error {
	if !r.watches(mStreamSynchronize) {
		return r.Runtime.StreamSynchronize(dev, s)
	}
	c := r.call(mStreamSynchronize, dev, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.StreamSynchronize(arg[int](c, 0), arg[cudart.Stream](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// StreamDevice intercepts cudart.Runtime.StreamDevice.
func (r *Runtime) StreamDevice(dev int, s cudart.Stream) (int, error) {
	if !r.watches(mStreamDevice) {
		return r.Runtime.StreamDevice(dev, s)
	}
	c := r.call(mStreamDevice, dev, s)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.StreamDevice(arg[int](c, 0), arg[cudart.Stream](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[int](c, 0), c.Err
}

// StreamWaitEvent intercepts cudart.Runtime.StreamWaitEvent.
func (r *Runtime) StreamWaitEvent(dev int, s cudart.Stream, e cudart.Event) error {
	if !r.watches(mStreamWaitEvent) {
		return r.Runtime.StreamWaitEvent(dev, s, e)
	}
	c := r.call(mStreamWaitEvent, dev, s, e)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.StreamWaitEvent(arg[int](c, 0), arg[cudart.Stream](c, 1), arg[cudart.Event](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// StreamNotify intercepts cudart.Runtime.StreamNotify.
func (r *Runtime) StreamNotify(dev int, s cudart.Stream, fd int) error {
	if !r.watches(mStreamNotify) {
		return r.Runtime.StreamNotify(dev, s, fd)
	}
	c := r.call(mStreamNotify, dev, s, fd)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.StreamNotify(arg[int](c, 0), arg[cudart.Stream](c, 1), arg[int](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// EventCreate intercepts cudart.Runtime.EventCreate.
func (r *Runtime) EventCreate(dev int, flags cudart.EventFlags) (cudart.Event, error) {
	if !r.watches(mEventCreate) {
		return r.Runtime.EventCreate(dev, flags)
	}
	c := r.call(mEventCreate, dev, flags)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.EventCreate(arg[int](c, 0), arg[cudart.EventFlags](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.Event](c, 0), c.Err
}

// EventDestroy intercepts cudart.Runtime.EventDestroy.
func (r *Runtime) EventDestroy(dev int, e cudart.Event) error {
	if !r.watches(mEventDestroy) {
		return r.Runtime.EventDestroy(dev, e)
	}
	c := r.call(mEventDestroy, dev, e)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.EventDestroy(arg[int](c, 0), arg[cudart.Event](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// EventRecord intercepts cudart.Runtime.EventRecord.
func (r *Runtime) EventRecord(dev int, e cudart.Event, s cudart.Stream) error {
	if !r.watches(mEventRecord) {
		return r.Runtime.EventRecord(dev, e, s)
	}
	c := r.call(mEventRecord, dev, e, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.EventRecord(arg[int](c, 0), arg[cudart.Event](c, 1), arg[cudart.Stream](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// EventSynchronize intercepts cudart.Runtime.EventSynchronize.
func (r *Runtime) EventSynchronize(dev int, e cudart.Event) error {
	if !r.watches(mEventSynchronize) {
		return r.Runtime.EventSynchronize(dev, e)
	}
	c := r.call(mEventSynchronize, dev, e)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.EventSynchronize(arg[int](c, 0), arg[cudart.Event](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// EventQuery intercepts cudart.Runtime.EventQuery.
func (r *Runtime) EventQuery(dev int, e cudart.Event) (bool, error) {
	if !r.watches(mEventQuery) {
		return r.Runtime.EventQuery(dev, e)
	}
	c := r.call(mEventQuery, dev, e)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.EventQuery(arg[int](c, 0), arg[cudart.Event](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[bool](c, 0), c.Err
}

// IpcGetEventHandle intercepts cudart.Runtime.IpcGetEventHandle.
func (r *Runtime) IpcGetEventHandle(dev int, e cudart.Event) (cudart.IpcEventHandle, error) {
	if !r.watches(mIpcGetEventHandle) {
		return r.Runtime.IpcGetEventHandle(dev, e)
	}
	c := r.call(mIpcGetEventHandle, dev, e)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.IpcGetEventHandle(arg[int](c, 0), arg[cudart.Event](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.IpcEventHandle](c, 0), c.Err
}

// IpcOpenEventHandle intercepts cudart.Runtime.IpcOpenEventHandle.
func (r *Runtime) IpcOpenEventHandle(dev int, h cudart.IpcEventHandle) (cudart.Event, error) {
	if !r.watches(mIpcOpenEventHandle) {
		return r.Runtime.IpcOpenEventHandle(dev, h)
	}
	c := r.call(mIpcOpenEventHandle, dev, h)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.IpcOpenEventHandle(arg[int](c, 0), arg[cudart.IpcEventHandle](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.Event](c, 0), c.Err
}

// MemPoolCreate intercepts cudart.Runtime.MemPoolCreate.
func (r *Runtime) MemPoolCreate(props cudart.PoolProps) (cudart.MemPool, error) {
	if !r.watches(mMemPoolCreate) {
		return r.Runtime.MemPoolCreate(props)
	}
	c := r.call(mMemPoolCreate, props)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolCreate(arg[cudart.PoolProps](c, 0))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.MemPool](c, 0), c.Err
}

// MemPoolDestroy intercepts cudart.Runtime.MemPoolDestroy.
func (r *Runtime) MemPoolDestroy(dev int, p cudart.MemPool) error {
	if !r.watches(mMemPoolDestroy) {
		return r.Runtime.MemPoolDestroy(dev, p)
	}
	c := r.call(mMemPoolDestroy, dev, p)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemPoolDestroy(arg[int](c, 0), arg[cudart.MemPool](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// DeviceGetDefaultMemPool intercepts cudart.Runtime.DeviceGetDefaultMemPool.
func (r *Runtime) DeviceGetDefaultMemPool(dev int) (cudart.MemPool, error) {
	if !r.watches(mDeviceGetDefaultMemPool) {
		return r.Runtime.DeviceGetDefaultMemPool(dev)
	}
	c := r.call(mDeviceGetDefaultMemPool, dev)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.DeviceGetDefaultMemPool(arg[int](c, 0))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.MemPool](c, 0), c.Err
}

// MemPoolGetAttribute intercepts cudart.Runtime.MemPoolGetAttribute.
func (r *Runtime) MemPoolGetAttribute(dev int, p cudart.MemPool, attr cudart.PoolAttr) (uint64, error) {
	if !r.watches(mMemPoolGetAttribute) {
		return r.Runtime.MemPoolGetAttribute(dev, p, attr)
	}
	c := r.call(mMemPoolGetAttribute, dev, p, attr)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolGetAttribute(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[cudart.PoolAttr](c, 2))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[uint64](c, 0), c.Err
}

// MemPoolSetAttribute intercepts cudart.Runtime.MemPoolSetAttribute.
func (r *Runtime) MemPoolSetAttribute(dev int, p cudart.MemPool, attr cudart.PoolAttr, value uint64) error {
	if !r.watches(mMemPoolSetAttribute) {
		return r.Runtime.MemPoolSetAttribute(dev, p, attr, value)
	}
	c := r.call(mMemPoolSetAttribute, dev, p, attr, value)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemPoolSetAttribute(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[cudart.PoolAttr](c, 2), arg[uint64](c, 3))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemPoolSetAccess intercepts cudart.Runtime.MemPoolSetAccess.
func (r *Runtime) MemPoolSetAccess(dev int, p cudart.MemPool, descs []cudart.AccessDesc) error {
	if !r.watches(mMemPoolSetAccess) {
		return r.Runtime.MemPoolSetAccess(dev, p, descs)
	}
	c := r.call(mMemPoolSetAccess, dev, p, descs)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemPoolSetAccess(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[[]cudart.AccessDesc](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemPoolGetAccess intercepts cudart.Runtime.MemPoolGetAccess.
func (r *Runtime) MemPoolGetAccess(dev int, p cudart.MemPool, loc cudart.Location) (cudart.AccessFlags, error) {
	if !r.watches(mMemPoolGetAccess) {
		return r.Runtime.MemPoolGetAccess(dev, p, loc)
	}
	c := r.call(mMemPoolGetAccess, dev, p, loc)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolGetAccess(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[cudart.Location](c, 2))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.AccessFlags](c, 0), c.Err
}

// MemPoolTrimTo intercepts cudart.Runtime.MemPoolTrimTo.
func (r *Runtime) MemPoolTrimTo(dev int, p cudart.MemPool, minBytesToKeep uint64) error {
	if !r.watches(mMemPoolTrimTo) {
		return r.Runtime.MemPoolTrimTo(dev, p, minBytesToKeep)
	}
	c := r.call(mMemPoolTrimTo, dev, p, minBytesToKeep)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemPoolTrimTo(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[uint64](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MallocFromPoolAsync intercepts cudart.Runtime.MallocFromPoolAsync.
func (r *Runtime) MallocFromPoolAsync(dev int, size uint64, p cudart.MemPool, s cudart.Stream) (cudart.DevicePtr, error) {
	if !r.watches(mMallocFromPoolAsync) {
		return r.Runtime.MallocFromPoolAsync(dev, size, p, s)
	}
	c := r.call(mMallocFromPoolAsync, dev, size, p, s)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MallocFromPoolAsync(arg[int](c, 0), arg[uint64](c, 1), arg[cudart.MemPool](c, 2), arg[cudart.Stream](c, 3))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.DevicePtr](c, 0), c.Err
}

// FreeAsync intercepts cudart.Runtime.FreeAsync.
func (r *Runtime) FreeAsync(dev int, ptr cudart.DevicePtr, s cudart.Stream) error {
	if !r.watches(mFreeAsync) {
		return r.Runtime.FreeAsync(dev, ptr, s)
	}
	c := r.call(mFreeAsync, dev, ptr, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.FreeAsync(arg[int](c, 0), arg[cudart.DevicePtr](c, 1), arg[cudart.Stream](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemPoolExportToShareableHandle intercepts cudart.Runtime.MemPoolExportToShareableHandle.
func (r *Runtime) MemPoolExportToShareableHandle(dev int, p cudart.MemPool, ht cudart.HandleType) (cudart.ShareableHandle, error) {
	if !r.watches(mMemPoolExportToShareableHandle) {
		return r.Runtime.MemPoolExportToShareableHandle(dev, p, ht)
	}
	c := r.call(mMemPoolExportToShareableHandle, dev, p, ht)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolExportToShareableHandle(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[cudart.HandleType](c, 2))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.ShareableHandle](c, 0), c.Err
}

// MemPoolImportFromShareableHandle intercepts cudart.Runtime.MemPoolImportFromShareableHandle.
func (r *Runtime) MemPoolImportFromShareableHandle(dev int, h cudart.ShareableHandle) (cudart.MemPool, error) {
	if !r.watches(mMemPoolImportFromShareableHandle) {
		return r.Runtime.MemPoolImportFromShareableHandle(dev, h)
	}
	c := r.call(mMemPoolImportFromShareableHandle, dev, h)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolImportFromShareableHandle(arg[int](c, 0), arg[cudart.ShareableHandle](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.MemPool](c, 0), c.Err
}

// MemPoolExportPointer intercepts cudart.Runtime.MemPoolExportPointer.
func (r *Runtime) MemPoolExportPointer(dev int, ptr cudart.DevicePtr) (cudart.PtrExportData, error) {
	if !r.watches(mMemPoolExportPointer) {
		return r.Runtime.MemPoolExportPointer(dev, ptr)
	}
	c := r.call(mMemPoolExportPointer, dev, ptr)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolExportPointer(arg[int](c, 0), arg[cudart.DevicePtr](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.PtrExportData](c, 0), c.Err
}

// MemPoolImportPointer intercepts cudart.Runtime.MemPoolImportPointer.
func (r *Runtime) MemPoolImportPointer(dev int, p cudart.MemPool, data cudart.PtrExportData) (cudart.DevicePtr, error) {
	if !r.watches(mMemPoolImportPointer) {
		return r.Runtime.MemPoolImportPointer(dev, p, data)
	}
	c := r.call(mMemPoolImportPointer, dev, p, data)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.MemPoolImportPointer(arg[int](c, 0), arg[cudart.MemPool](c, 1), arg[cudart.PtrExportData](c, 2))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.DevicePtr](c, 0), c.Err
}

// MemcpyHtoDAsync intercepts cudart.Runtime.MemcpyHtoDAsync.
func (r *Runtime) MemcpyHtoDAsync(dev int, dst cudart.DevicePtr, src []byte, s cudart.Stream) error {
	if !r.watches(mMemcpyHtoDAsync) {
		return r.Runtime.MemcpyHtoDAsync(dev, dst, src, s)
	}
	c := r.call(mMemcpyHtoDAsync, dev, dst, src, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemcpyHtoDAsync(arg[int](c, 0), arg[cudart.DevicePtr](c, 1), arg[[]byte](c, 2), arg[cudart.Stream](c, 3))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemcpyDtoHAsync intercepts cudart.Runtime.MemcpyDtoHAsync.
func (r *Runtime) MemcpyDtoHAsync(dev int, dst []byte, src cudart.DevicePtr, s cudart.Stream) error {
	if !r.watches(mMemcpyDtoHAsync) {
		return r.Runtime.MemcpyDtoHAsync(dev, dst, src, s)
	}
	c := r.call(mMemcpyDtoHAsync, dev, dst, src, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemcpyDtoHAsync(arg[int](c, 0), arg[[]byte](c, 1), arg[cudart.DevicePtr](c, 2), arg[cudart.Stream](c, 3))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemcpyDtoDAsync intercepts cudart.Runtime.MemcpyDtoDAsync.
func (r *Runtime) MemcpyDtoDAsync(dev int, dst cudart.DevicePtr, src cudart.DevicePtr, n uint64, s cudart.Stream) error {
	if !r.watches(mMemcpyDtoDAsync) {
		return r.Runtime.MemcpyDtoDAsync(dev, dst, src, n, s)
	}
	c := r.call(mMemcpyDtoDAsync, dev, dst, src, n, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemcpyDtoDAsync(arg[int](c, 0), arg[cudart.DevicePtr](c, 1), arg[cudart.DevicePtr](c, 2), arg[uint64](c, 3), arg[cudart.Stream](c, 4))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// MemsetAsync intercepts cudart.Runtime.MemsetAsync.
func (r *Runtime) MemsetAsync(dev int, dst cudart.DevicePtr, value byte, n uint64, s cudart.Stream) error {
	if !r.watches(mMemsetAsync) {
		return r.Runtime.MemsetAsync(dev, dst, value, n, s)
	}
	c := r.call(mMemsetAsync, dev, dst, value, n, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemsetAsync(arg[int](c, 0), arg[cudart.DevicePtr](c, 1), arg[byte](c, 2), arg[uint64](c, 3), arg[cudart.Stream](c, 4))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// HostRegister intercepts cudart.Runtime.HostRegister.
func (r *Runtime) HostRegister(dev int, mem []byte, flags cudart.HostRegisterFlags) error {
	if !r.watches(mHostRegister) {
		return r.Runtime.HostRegister(dev, mem, flags)
	}
	c := r.call(mHostRegister, dev, mem, flags)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.HostRegister(arg[int](c, 0), arg[[]byte](c, 1), arg[cudart.HostRegisterFlags](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// HostUnregister intercepts cudart.Runtime.HostUnregister.
func (r *Runtime) HostUnregister(dev int, mem []byte) error {
	if !r.watches(mHostUnregister) {
		return r.Runtime.HostUnregister(dev, mem)
	}
	c := r.call(mHostUnregister, dev, mem)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.HostUnregister(arg[int](c, 0), arg[[]byte](c, 1))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// HostDevicePointer intercepts cudart.Runtime.HostDevicePointer.
func (r *Runtime) HostDevicePointer(dev int, mem []byte) (cudart.DevicePtr, error) {
	if !r.watches(mHostDevicePointer) {
		return r.Runtime.HostDevicePointer(dev, mem)
	}
	c := r.call(mHostDevicePointer, dev, mem)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.HostDevicePointer(arg[int](c, 0), arg[[]byte](c, 1))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.DevicePtr](c, 0), c.Err
}

// MemcpyBatchAsync intercepts cudart.Runtime.MemcpyBatchAsync.
func (r *Runtime) MemcpyBatchAsync(dev int, pieces []cudart.CopyPiece, s cudart.Stream) error {
	if !r.watches(mMemcpyBatchAsync) {
		return r.Runtime.MemcpyBatchAsync(dev, pieces, s)
	}
	c := r.call(mMemcpyBatchAsync, dev, pieces, s)
	if c.Err == nil && !c.answered {
		c.Err = r.Runtime.MemcpyBatchAsync(arg[int](c, 0), arg[[]cudart.CopyPiece](c, 1), arg[cudart.Stream](c, 2))
		c.ran = true
	}
	r.done(c)
	return c.Err
}

// BatchCopyPath intercepts cudart.Runtime.BatchCopyPath.
func (r *Runtime) BatchCopyPath(dev int) (cudart.CopyPath, error) {
	if !r.watches(mBatchCopyPath) {
		return r.Runtime.BatchCopyPath(dev)
	}
	c := r.call(mBatchCopyPath, dev)
	if c.Err == nil && !c.answered {
		v0, err := r.Runtime.BatchCopyPath(arg[int](c, 0))
		c.Results, c.Err = []any{v0}, err
		c.ran = true
	}
	r.done(c)
	return result[cudart.CopyPath](c, 0), c.Err
}
