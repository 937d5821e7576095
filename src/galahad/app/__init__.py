"""The use cases: lookup, save, load, commit and quarantine over a store, a cipher and a layout."""
