"""What each API dialect's requests and answers look like, and how a job's events render into them: pure, no I/O."""
