"""trio building blocks with no other aenv imports: mailboxes, busy errors, supervisors,
retries with backoff, exception-group helpers, metrics, fault points, the refill
pacing of things made ahead."""
