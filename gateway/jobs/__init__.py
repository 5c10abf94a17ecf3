"""A request's job: submitted, followed to its end, streamed or gathered, resumed, detached."""
