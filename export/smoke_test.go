package export

import "testing"

func TestSmokeOpenReadRelease(t *testing.T) {
	pr := newProducer(t, nil, nil)
	pr.publish(t, "a", 1<<20, 0x5a)
	c := newConsumer(t, pr.path, 0)
	ctx := testCtx(t)
	m, err := c.imp.Open(ctx, "a", c.stream)
	if err != nil {
		t.Fatal(err)
	}
	if got := c.read(t, m); !allAre(got, 0x5a) {
		t.Fatalf("read %x...", got[:8])
	}
	if err := m.Release(ctx, c.stream); err != nil {
		t.Fatal(err)
	}
	if err := c.imp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pr.ex.Close(ctx); err != nil {
		t.Fatal(err)
	}
	pr.checkClean(t)
	c.checkClean(t)
	t.Log(pr.log.String())
}
