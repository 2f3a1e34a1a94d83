"""Tensors on the wire: the codec (header + raw bytes) and the gRPC plumbing."""
