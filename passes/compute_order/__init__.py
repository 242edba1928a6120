"""Compute order: passes that move row filters and slices so the model computes only what it keeps."""
