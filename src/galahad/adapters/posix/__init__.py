"""POSIX file helpers shared by the adapters: bounded reads of regular files, private folders,
and the compiled read-and-verify loop of a checksum frame."""
