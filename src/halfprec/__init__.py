"""halfprec: low-precision training template."""
