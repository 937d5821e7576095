"""Helper processes: loads read and verified outside the engine process's interpreter lock."""
