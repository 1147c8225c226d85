package owner

// The LRU lists of a slab's sealed pages and of a host tier's: doubly linked lists of
// a table's entries by index, head the most recent, none at the ends. links gives an
// entry's neighbours: prev is the more recent.

// lruRemove takes p out of the list.
func lruRemove(head, tail *uint32, p uint32, links func(uint32) (prev, next *uint32)) {
	prev, next := links(p)
	if *prev != none {
		_, n := links(*prev)
		*n = *next
	} else {
		*head = *next
	}
	if *next != none {
		pp, _ := links(*next)
		*pp = *prev
	} else {
		*tail = *prev
	}
	*prev, *next = none, none
}

// lruPushFront makes p, in no list, the most recent.
func lruPushFront(head, tail *uint32, p uint32, links func(uint32) (prev, next *uint32)) {
	prev, next := links(p)
	*prev, *next = none, *head
	if *head != none {
		pp, _ := links(*head)
		*pp = p
	} else {
		*tail = p
	}
	*head = p
}
