"""The Uploads service: resumable, content-addressed uploads kept on disk."""
