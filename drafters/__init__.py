"""specula.drafters."""
