"""Use cases behind the HTTP routes. Nothing here imports FastAPI or Starlette."""
