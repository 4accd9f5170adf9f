"""The load path: find the newest step that checks, verify it, read it into the state."""
