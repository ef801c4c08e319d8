"""stream_app."""
