"""How it travels: the object collectives' pipeline (pipeline) over the header exchange
(header_exchange) and its routes (routes), point-to-point messages (messages, p2p, transport),
all_to_all, and small reductions gathered on the root (gathered_reduce)."""
