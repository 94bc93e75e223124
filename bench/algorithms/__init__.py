"""The algorithms compared by what they learn at equal samples: the roles, staleness
and the loss form."""
