"""trio building blocks with no other aenv imports: mailboxes, busy errors, metrics."""
