"""The engine (build, the loop, summarize); importing this package loads nothing: validate runs before torch."""
