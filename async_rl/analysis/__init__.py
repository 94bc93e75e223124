"""Reading runs back: idle time by cause, the Perfetto trace and timeline, reports, sweeps."""
