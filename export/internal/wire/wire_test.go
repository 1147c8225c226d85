package wire

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/cudapool/cudapool/cudart"
	"github.com/cudapool/cudapool/export"
)

// sampleMessages has one well-formed message of every type, each field set so that a
// field dropped or swapped by the codec shows.
func sampleMessages() []Message {
	var rec cudart.PtrExportData
	var ev cudart.IpcEventHandle
	var fab cudart.FabricHandle
	for i := range rec {
		rec[i], ev[i], fab[i] = byte(i+1), byte(200-i), byte(i*3)
	}
	l := LeaseMsg{ReqID: 7, LeaseID: 0xdeadbeefcafe, PoolID: 3, BufferID: 9, Size: 1 << 21, Offset: 4096, Length: 1000,
		Flags: LeaseReadyEvent, Record: rec, Ready: ev, Meta: []byte(`{"dtype":"float16","shape":[2,250]}`)}
	return []Message{
		&HelloMsg{Version: export.ProtocolVersion, PID: 4242, Flags: HelloLeases | HelloReleaseEvent, HandleTypes: uint32(cudart.HandleTypePosixFD | cudart.HandleTypeFabric), Device: cudart.UUID{1, 2, 3}, ReleaseEvent: ev},
		&WelcomeMsg{Version: export.ProtocolVersion, PID: 17, Flags: WelcomeRetain, Devices: []cudart.UUID{{9}, {8, 7}}},
		&RefusedMsg{Version: export.ProtocolVersion, Reason: "uid 1001 is not allowed"},
		&PoolHandleMsg{PoolID: 3, HandleType: cudart.HandleTypePosixFD, Device: cudart.UUID{5}, MaxSize: 64 << 20},
		&PoolHandleMsg{PoolID: 4, HandleType: cudart.HandleTypeFabric, Device: cudart.UUID{6}, MaxSize: 1 << 30, Fabric: fab},
		&OpenMsg{ReqID: 1, Name: "kv/layer-0"},
		&l,
		&PushMsg{LeaseMsg: LeaseMsg{LeaseID: 5, PoolID: 3, BufferID: 2, Size: 512, Length: 512, Record: rec, Meta: []byte{1, 2}}, Name: "pushed"},
		&ReleaseMsg{ReqID: 8, LeaseID: 0xdeadbeefcafe, Count: 2, Flags: ReleaseNothingImported},
		&ReleasedMsg{ReqID: 8, LeaseID: 0xdeadbeefcafe},
		&ErrorMsg{ReqID: 1, Code: codeUnknownName, Text: "no buffer named \"x\""},
		&StateRequestMsg{ReqID: 99},
		&StateMsg{ReqID: 99, Flags: StateMore, JSON: []byte(`{"pid":1}`)},
		&ByeMsg{},
		&RevokeMsg{Record: rec},
		&RevokedMsg{Record: rec},
		&OpenBatchMsg{ReqID: 3, Names: []string{"a", "kv/block-17"}},
		&LeaseBatchMsg{ReqID: 7, Flags: LeaseBatchMore, Leases: []LeaseMsg{l, l}},
		&ReleaseBatchMsg{ReqID: 9, Entries: []ReleaseMsg{{LeaseID: 5, Count: 2, Flags: ReleaseRetain}, {LeaseID: 6, Count: 1}}},
		&ChunkHandleMsg{AllocID: 2, Size: 2 << 20, Index: 1, Count: 3, HandleType: cudart.HandleTypePosixFD, Device: cudart.UUID{4}},
		&ChunkHandleMsg{AllocID: 3, Size: 2 << 20, Index: 0, Count: 1, HandleType: cudart.HandleTypeFabric, Device: cudart.UUID{4}, Fabric: fab},
		&LeaseMsg{ReqID: 8, LeaseID: 0xdeadbeefcaff, PoolID: 2, Size: 6 << 20, Offset: 1 << 20, Length: 4 << 20,
			Flags: LeaseReadyEvent | LeaseVMM, Ready: ev, Meta: []byte("kv")},
		&DropChunksMsg{AllocID: 2},
	}
}

func TestFramesRoundTrip(t *testing.T) {
	var stream []byte
	msgs := sampleMessages()
	for _, m := range msgs {
		stream = AppendFrame(stream, m)
	}
	rest := stream
	for i, want := range msgs {
		got, r, err := decodeFrame(rest)
		require.NoError(t, err, "message %d (%s): %v", i, want.Kind(), err)
		a, b := AppendFrame(nil, got), AppendFrame(nil, want)
		require.True(t, bytes.Equal(a, b), "message %d (%s) changed in a round trip:\n got %x\nwant %x", i, want.Kind(), a, b)
		rest = r
	}
	require.Len(t, rest, 0, "%d bytes left over", len(rest))
}

// frame builds raw frame bytes with any header, right or wrong.
func frame(length uint32, t MsgType, payload []byte) []byte {
	b := Le.AppendUint32(nil, length)
	return append(append(b, byte(t)), payload...)
}

// withField returns a well-formed frame of m with the payload bytes at off replaced.
func withField(m Message, off int, v []byte) []byte {
	b := AppendFrame(nil, m)
	copy(b[HeaderLen+off:], v)
	return b
}

// malformedFrame is a frame the decoder must refuse, and what its error must say.
type malformedFrame struct {
	name string
	b    []byte
	want string
}

func malformedFrames() []malformedFrame {
	good := sampleMessages()
	goodHello, goodLease := good[0], good[6]
	return []malformedFrame{
		{name: "short header", b: []byte{1, 0, 0}, want: "truncated frame header"},
		{name: "unknown type", b: frame(0, 0x7f, nil), want: "unknown message type 127"},
		{name: "type zero", b: frame(0, 0, nil), want: "unknown message type 0"},
		{name: "oversized", b: frame(MaxPayload+1, MsgOpen, nil), want: "oversized frame"},
		{name: "huge length", b: frame(0xffffffff, MsgState, nil), want: "oversized frame"},
		{name: "wrong length", b: frame(10, MsgLease, make([]byte, 10)), want: "Lease payload is 10 bytes, want 192 to 4288"},
		{name: "bye with payload", b: frame(1, MsgBye, []byte{0}), want: "Bye payload is 1 bytes, want 0"},
		{name: "truncated payload", b: frame(8, MsgStateRequest, []byte{1, 2}), want: "truncated StateRequest frame"},
		{name: "open without name", b: frame(8, MsgOpen, make([]byte, 8)), want: "Open payload is 8 bytes, want 9 to 263"},
		{name: "name not utf8", b: frame(9, MsgOpen, append(make([]byte, 8), 0xff)), want: "not UTF-8"},
		{name: "name with NUL", b: frame(10, MsgOpen, append(make([]byte, 8), 'a', 0)), want: "control character"},
		{name: "unknown hello flag", b: withField(goodHello, 8, []byte{0x80}), want: "Hello has unknown flags 0x80"},
		{name: "release event without leases", b: withField(goodHello, 8, []byte{byte(HelloReleaseEvent)}), want: "takes no leases"},
		{name: "hello short", b: frame(20, MsgHello, Le.AppendUint32(make([]byte, 0, 20), export.ProtocolVersion)[:20:20]), want: "Hello payload is 20 bytes, want 96"},
		{name: "unknown lease flag", b: withField(goodLease, 56, []byte{4}), want: "Lease has unknown flags 0x4"},
		{name: "vmm lease with a record", b: withField(goodLease, 56, []byte{byte(LeaseReadyEvent | LeaseVMM)}), want: "VMM allocation carries a buffer id or a pointer's export record"},
		{name: "vmm lease with a buffer id", b: withField(good[21], 24, Le.AppendUint64(nil, 5)), want: "VMM allocation carries a buffer id"},
		{name: "chunk index past count", b: withField(good[19], 16, Le.AppendUint32(nil, 3)), want: "chunk 3 of 3"},
		{name: "chunk count zero", b: withField(good[19], 20, Le.AppendUint32(nil, 0)), want: "allocation of 0 chunks"},
		{name: "chunk count past the limit", b: withField(good[19], 20, Le.AppendUint32(nil, export.MaxChunks+1)), want: "allocation of 4097 chunks"},
		{name: "chunk of no bytes", b: withField(good[19], 8, Le.AppendUint64(nil, 0)), want: "chunk of 0 bytes"},
		{name: "chunk of allocation zero", b: withField(good[19], 0, Le.AppendUint64(nil, 0)), want: "ChunkHandle of allocation 0"},
		{name: "chunk handle type none", b: withField(good[19], 24, Le.AppendUint32(nil, 0)), want: "ChunkHandle has handle type"},
		{name: "fd chunk with fabric bytes", b: withField(good[19], 44, []byte{1}), want: "POSIX fd ChunkHandle carries fabric bytes"},
		{name: "drop chunks of allocation zero", b: withField(good[22], 0, Le.AppendUint64(nil, 0)), want: "DropChunks of allocation 0"},
		{name: "event bytes without flag", b: withField(goodLease, 56, []byte{0}), want: "without the ready-event flag"},
		{name: "lease range past the end", b: withField(goodLease, 40, Le.AppendUint64(nil, 1<<21)), want: "1000 bytes at offset 2097152 of a 2097152-byte buffer"},
		{name: "lease empty range", b: withField(goodLease, 48, Le.AppendUint64(nil, 0)), want: "0 bytes at offset 4096"},
		{name: "lease metadata past the frame", b: withField(goodLease, 60, Le.AppendUint32(nil, 100)), want: "100 bytes of metadata, 35 are there"},
		{name: "lease bytes after metadata", b: withField(goodLease, 60, Le.AppendUint32(nil, 3)), want: "Lease has 32 bytes after its metadata"},
		{name: "push with request id", b: AppendFrame(nil, &PushMsg{LeaseMsg: LeaseMsg{ReqID: 3, Size: 1, Length: 1}, Name: "x"}), want: "Push has request id 3"},
		{name: "pool handle type none", b: AppendFrame(nil, &PoolHandleMsg{HandleType: cudart.HandleTypeNone}), want: "handle type none"},
		{name: "fd pool with fabric bytes", b: AppendFrame(nil, &PoolHandleMsg{HandleType: cudart.HandleTypePosixFD, Fabric: cudart.FabricHandle{1}}), want: "carries fabric bytes"},
		{name: "welcome unknown flag", b: withField(good[1], 8, []byte{2}), want: "Welcome has unknown flags 0x2"},
		{name: "welcome too many devices", b: withField(good[1], 12, []byte{17}), want: "lists 17 devices"},
		{name: "welcome unused slot", b: withField(good[1], 16+2*16, []byte{1}), want: "unused device slot 2"},
		{name: "error code zero", b: withField(good[10], 8, []byte{0}), want: "unknown code 0"},
		{name: "error code unknown", b: withField(good[10], 8, []byte{byte(CodeLimit)}), want: "unknown code"},
		{name: "error text not utf8", b: frame(13, MsgError, append(Le.AppendUint32(Le.AppendUint64(nil, 1), 1), 0xc3)), want: "Error text is not UTF-8"},
		{name: "unknown release flag", b: withField(good[8], 20, []byte{4}), want: "Release has unknown flags 0x4"},
		{name: "unknown state flag", b: withField(good[12], 8, []byte{2}), want: "State has unknown flags 0x2"},
	}
}

func TestDecoderRefusesMalformedFrames(t *testing.T) {
	for _, c := range malformedFrames() {
		t.Run(c.name, func(t *testing.T) {
			m, _, err := decodeFrame(c.b)
			require.Error(t, err, "decoded %#v, want an error", m)
			require.ErrorIs(t, err, export.ErrProtocol, "error %q, want export.ErrProtocol saying %q", err, c.want)
			require.ErrorContains(t, err, c.want, "error %q, want export.ErrProtocol saying %q", err, c.want)
		})
	}
}

func TestDecoderNamesBothVersions(t *testing.T) {
	// A Hello of a newer version may be longer, an old one shorter; the version is read
	// first and named.
	for _, c := range []struct{ version, length uint32 }{{export.ProtocolVersion + 1, 200}, {1, helloLen}} {
		b := frame(c.length, MsgHello, Le.AppendUint32(make([]byte, 0, c.length), c.version)[:c.length])
		_, _, err := decodeFrame(b)
		want := fmt.Sprintf("version %d, this side speaks %d", c.version, export.ProtocolVersion)
		require.ErrorIs(t, err, export.ErrVersionMismatch, "error %v, want export.ErrVersionMismatch saying %q", err, want)
		require.ErrorContains(t, err, want)
	}
}

func TestCodeOfMapsEverySentinel(t *testing.T) {
	for c := codeExporter + 1; c < CodeLimit; c++ {
		if c == codeClosed {
			continue // export.ErrExporterGone on the importer's side, from export.ErrClosed on the exporter's
		}
		if c == codeForeignLease || c == codeForgedLease {
			assert.Equal(t, codeStaleLease, CodeOf(CodeErrs[c]), "codeOf(%v) from code %d", CodeErrs[c], c)
			continue // read as export.ErrStaleLease, sent as codeStaleLease
		}
		assert.Equal(t, c, CodeOf(errors.Join(errors.New("context"), CodeErrs[c])), "codeOf(%v)", CodeErrs[c])
	}
	assert.Equal(t, codeClosed, CodeOf(export.ErrClosed), "codeOf(export.ErrClosed)")
	assert.Equal(t, codeExporter, CodeOf(errors.New("cuda failed")), "codeOf(other)")
}

// FuzzDecodeFrame feeds the decoder arbitrary bytes. It must never panic, and a frame
// it accepts must encode back to exactly the bytes it was decoded from: the decoder
// accepts one spelling of each message and nothing else.
func FuzzDecodeFrame(f *testing.F) {
	for _, m := range sampleMessages() {
		f.Add(AppendFrame(nil, m))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, rest, err := decodeFrame(b)
		if err != nil {
			require.False(t, !errors.Is(err, export.ErrProtocol) && !errors.Is(err, export.ErrVersionMismatch), "error %v wraps neither export.ErrProtocol nor export.ErrVersionMismatch", err)
			return
		}
		used := b[:len(b)-len(rest)]
		again := AppendFrame(nil, m)
		require.True(t, bytes.Equal(again, used), "%s re-encodes differently:\n got %x\nwant %x", m.Kind(), again, used)
	})
}

// TestSeedCorpusCoversEveryType keeps the checked-in corpus honest: every message type
// has a seed there, and so does each malformed-input class the decoder names.
func TestSeedCorpusCoversEveryType(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeFrame")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	seen := map[MsgType]bool{}
	for _, e := range entries {
		b := readCorpusEntry(t, filepath.Join(dir, e.Name()))
		if m, _, err := decodeFrame(b); err == nil {
			seen[m.Kind()] = true
		}
	}
	for typ := MsgHello; typ <= MsgDropChunks; typ++ {
		assert.True(t, seen[typ], "no well-formed %s seed in %s", typ, dir)
	}
	assert.GreaterOrEqual(t, len(entries), int(MsgDropChunks)+10, "%d seeds, want the well-formed ones and at least 10 malformed", len(entries))
}

var writeCorpus = flag.Bool("write-corpus", false, "rewrite testdata/fuzz/FuzzDecodeFrame from sampleMessages and malformedFrames")

// TestWriteCorpus regenerates the checked-in seed corpus when run with -write-corpus:
// one well-formed frame of every type, and every malformed frame the decoder test
// names, so that the fuzzer starts from each class of input the decoder tells apart.
func TestWriteCorpus(t *testing.T) {
	if !*writeCorpus {
		t.Skip("run with -write-corpus to regenerate the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeFrame")
	require.NoError(t, os.MkdirAll(dir, 0o755))
	write := func(name string, b []byte) {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", b)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644))
	}
	for i, m := range sampleMessages() {
		write(fmt.Sprintf("good-%02d-%s", i, m.Kind()), AppendFrame(nil, m))
	}
	for _, c := range malformedFrames() {
		write("bad-"+strings.ReplaceAll(c.name, " ", "-"), c.b)
	}
}

// readCorpusEntry reads the []byte of a one-argument corpus file.
func readCorpusEntry(t *testing.T, path string) []byte {
	t.Helper()
	body, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(body)), "\n")
	require.False(t, len(lines) != 2 || lines[0] != "go test fuzz v1" || !strings.HasPrefix(lines[1], "[]byte(") || !strings.HasSuffix(lines[1], ")"), "%s: not a one-[]byte corpus file", path)
	s, err := strconv.Unquote(strings.TrimSuffix(strings.TrimPrefix(lines[1], "[]byte("), ")"))
	require.NoError(t, err, "%s: %v", path, err)
	return []byte(s)
}

// decodeFrame decodes the first whole frame of b and returns what follows it.
func decodeFrame(b []byte) (Message, []byte, error) {
	if len(b) < HeaderLen {
		return nil, nil, ProtocolErr("truncated frame header: %d of %d bytes", len(b), HeaderLen)
	}
	t, n, err := parseHeader(b[:HeaderLen])
	if err != nil {
		return nil, nil, err
	}
	if len(b)-HeaderLen < n {
		return nil, nil, ProtocolErr("truncated %s frame: %d of %d payload bytes", t, len(b)-HeaderLen, n)
	}
	m, err := DecodePayload(t, b[HeaderLen:HeaderLen+n])
	if err != nil {
		return nil, nil, err
	}
	return m, b[HeaderLen+n:], nil
}
