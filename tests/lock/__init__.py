"""The lock's lifecycle in a task: every exit path, retries, fencing, pools."""
