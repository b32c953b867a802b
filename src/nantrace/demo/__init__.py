"""The built-in demonstration: a small transformer that meets a real numerical failure."""
