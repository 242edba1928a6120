"""Cleanup: passes that remove what the exporter left behind (identities, constants, duplicates, dead nodes)."""
