"""`/v1/batches` behind the scenes: the store of batch objects, the arq worker that runs them,
and the runner that turns each input line into one `batch`-class job on the model's streams."""
