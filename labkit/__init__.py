"""labkit: the tested implementations behind the efficient-LLM lab course.

Each technique lives once, in its own module (`labkit.bench`, `labkit.evaluate`, ...);
the notebooks in `labs/` import it and explain it.
"""

__version__ = "0.1.0"
