"""Job execution: Celery app and tasks (thin), and the framework-free pipeline they call."""
