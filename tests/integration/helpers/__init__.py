"""Programs the filesystem store tests run in their own processes (crash, concurrency)."""
