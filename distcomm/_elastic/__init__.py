"""A job that outlives its ranks: the membership (membership: shrink, admit, who is lost), each
process's keep-alive (keepalive, liveness), waits that look at the peers and fail naming them
(waits, failure_report), a membership's group formed in a watched store (forming), and the
groups of a broken membership held until they can be freed (deferred_free)."""
