"""The package's version, in a module of its own so that any layer can name it (the package
root sits in the top layer: it imports the offline API lazily)."""

__version__ = "0.1.0"  # pyproject.toml's [project] version
