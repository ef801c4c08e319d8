"""notifiers."""
