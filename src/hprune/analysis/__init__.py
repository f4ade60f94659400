"""What each attention head does and how much it carries: head roles and LRP relevance (Voita et al.), MoA expert load."""
