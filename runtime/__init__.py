"""specula.runtime."""
