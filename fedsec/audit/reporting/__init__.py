"""The parts of ``fedsec audit report`` (:mod:`fedsec.audit.report` assembles the page):
the figures gathered from the log (:mod:`.summary`), HTML helpers (:mod:`.markup`),
the charts (:mod:`.charts`) and the page's sections (:mod:`.sections`)."""
