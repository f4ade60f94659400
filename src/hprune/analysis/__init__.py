"""Head-role analysis (Voita et al.): what each attention head does."""
