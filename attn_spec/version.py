"""The kit's version, in a module of its own so that anything can import it cheaply."""
__version__ = "0.1.0"
