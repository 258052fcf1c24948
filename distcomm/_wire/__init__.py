"""What travels: the frame format (frame), serializers and the safe loader (serialization, safe,
tensor_pickle), and the memory and size bounds (memory)."""
