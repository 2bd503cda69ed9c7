"""specula.protos."""
