"""The node: a supervisor owning one actor per sandbox, plus the shared services."""
