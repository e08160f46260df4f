"""Drop-in adapters for other projects' cache interfaces (none imports its peer)."""
