"""Studies: experiments that compose the trainers and measure them against known truth."""
