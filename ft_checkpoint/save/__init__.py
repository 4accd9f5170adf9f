"""The save path: staging, the background writers, the commit."""
