"""What a long call tells the user while it works: progress lines on stderr (``progress``) and
the resident memory of each stage of ``optimize`` (``memory_profile``)."""
