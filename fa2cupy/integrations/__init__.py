"""Integrations of fa2cupy with other libraries' extension points."""
