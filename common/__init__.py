"""The bottom layer: the errors every layer raises and the user's cache folder."""
