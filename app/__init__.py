"""HTTP front end. Importing this package must stay cheap: no FastAPI import at package level."""
