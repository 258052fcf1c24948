"""Members only: the job's key (key), the membership records signed with it (records), and the
proof every member of a new group gives the others before anything from a peer is loaded
(handshake). See docs/trust-model.md."""
