package consumer

// deliverPushes imports pushed buffers and hands them to the push handler, one at a
// time, until Close.
func (imp *Importer) deliverPushes() {
	defer close(imp.pushDone)
	for {
		imp.mu.Lock()
		batch := imp.pushes
		imp.pushes = nil
		closed := imp.cl.IsClosed()
		imp.mu.Unlock()
		for _, p := range batch {
			if closed || imp.opts.pushHandler == nil {
				imp.releaseUnused(&p.LeaseMsg)
				continue
			}
			m, err := imp.adopt(&p.LeaseMsg, p.Name, imp.opts.pushStream)
			if err != nil {
				imp.log.Warn("consumer: a pushed buffer could not be imported", "name", p.Name, "err", err)
				continue
			}
			imp.opts.pushHandler(p.Name, m)
		}
		if closed {
			return
		}
		<-imp.pushCue
	}
}
