"""What users store through the API, in Redis: files, batches, responses."""
